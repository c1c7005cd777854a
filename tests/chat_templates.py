"""Chat templates of the model families `cupool serve` parses, for the tiny test tokenizers.
(transformers renders templates with trim_blocks, so a newline right after a tag is written
as {{ '\\n' }}.) Each renders what its published template renders for the cases the tests use: a system
message, the tools, user turns, assistant turns with reasoning and tool calls, tool results, the
generation prompt and its thinking switch. They are written for these tests from the published
formats; only the markers and layout matter to the server.

FAMILIES maps a family to its template, its special and added tokens, and its EOS tokens."""

from __future__ import annotations

# --- Qwen3 / Qwen3-Next: JSON calls in <tool_call>, tools as JSON in <tools>, results as user
# turns of <tool_response>; Qwen3-Next's thinking model opens <think> in the generation prompt.
_QWEN_TOOLS = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}")
_QWEN_CALL_JSON = (
    "{% set tc = tool_call.function if tool_call.function is defined else tool_call %}"
    "<tool_call>\n{\"name\": \"{{ tc.name }}\", \"arguments\": "
    "{% if tc.arguments is string %}{{ tc.arguments }}{% else %}{{ tc.arguments | tojson }}"
    "{% endif %}}\n</tool_call>")
_QWEN_CALL_XML = (
    "{% set tc = tool_call.function if tool_call.function is defined else tool_call %}"
    "<tool_call>\n<function={{ tc.name }}>\n"
    "{% for k, v in tc.arguments.items() %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>")


def _qwen(call: str, think_open: bool, tools_block: str = _QWEN_TOOLS) -> str:
    gen = ("<|im_start|>assistant\n"
           "{% if enable_thinking is defined and enable_thinking is false %}"
           "<think>\n\n</think>\n\n"
           + ("{% else %}<think>\n" if think_open else "") + "{% endif %}")
    return (
        tools_block +
        "{% for message in messages %}"
        "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
        "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
        "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n"
        "</think>\n\n{% endif %}{{ message.content or '' }}"
        "{% for tool_call in message.tool_calls or [] %}"
        "{% if loop.first and message.content %}{{ '\\n' }}{% elif not loop.first %}{{ '\\n' }}{% endif %}"
        + call +
        "{% endfor %}<|im_end|>\n"
        "{% elif message.role == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
        "{% endif %}{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
        "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
        "{% elif message.role != 'system' %}"
        "{{ raise_exception('unknown role ' + message.role) }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}" + gen + "{% endif %}")


# Qwen3.8-Flash-Next: tools as XML, calls in the <function=...> dialect, thinking opened in the
# generation prompt.
_QWEN_XML_TOOLS = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "\n<function>\n<name>{{ f.name }}</name>\n<description>{{ f.description or '' }}"
    "</description>\n<parameters>{{ (f.parameters or {}) | tojson }}</parameters>\n</function>"
    "{% endfor %}{{ '\\n' }}</tools>\n\nIf you choose to call a function ONLY reply in the following "
    "format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}")

QWEN3 = _qwen(_QWEN_CALL_JSON, think_open=False)
QWEN3_NEXT = _qwen(_QWEN_CALL_JSON, think_open=True)
QWEN38_FLASH_NEXT = _qwen(_QWEN_CALL_XML, think_open=True, tools_block=_QWEN_XML_TOOLS)

# --- gpt-oss: harmony messages; tools as a TypeScript-like namespace in the developer message;
# calls on the commentary channel to=functions.NAME; results from functions.NAME to=assistant.
GPT_OSS = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: "
    "'functions'.{% endif %}<|end|>"
    "{% set sys = messages[0].content if messages[0].role in ['system', 'developer'] else '' %}"
    "{% if sys or tools %}<|start|>developer<|message|>"
    "{% if sys %}# Instructions\n\n{{ sys }}\n\n{% endif %}"
    "{% if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "// {{ f.description or '' }}\ntype {{ f.name }} = (_: {{ (f.parameters or {}) | tojson }})"
    " => any;\n\n{% endfor %}} // namespace functions{% endif %}<|end|>{% endif %}"
    "{% set ns = namespace(last_call='') %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{% elif message.role == 'assistant' %}"
    "{% set thinking = message.thinking or message.reasoning_content %}"
    "{% if message.tool_calls %}"
    "{% if thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>"
    "{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% set tc = tool_call.function if tool_call.function is defined else tool_call %}"
    "{% set ns.last_call = tc.name %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ tc.name }} <|constrain|>json"
    "<|message|>{{ tc.arguments | tojson }}<|call|>{% endfor %}"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{% endif %}"
    "{% elif message.role == 'tool' %}<|start|>functions.{{ ns.last_call }} to=assistant"
    "<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>"
    "{% elif message.role not in ['system', 'developer'] %}"
    "{{ raise_exception('unknown role ' + message.role) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

# --- DeepSeek-V3: tools listed in the system prompt, calls fenced as ```json, results in
# tool-output blocks.
DEEPSEEK_V3 = (
    "{% set ns = namespace(system='', in_outputs=false) %}"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{% set ns.system = ns.system + m.content %}{% endif %}{% endfor %}"
    "{% if tools %}{% set ns.system = ns.system + '\n\n## Tools\nYou have access to the "
    "following tools:\n' %}"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{% set ns.system = ns.system + '\n### ' + f.name + '\nDescription: ' + "
    "(f.description or '') + '\n\nParameters: ' + ((f.parameters or {}) | tojson) + '\n' %}"
    "{% endfor %}{% endif %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for m in messages %}"
    "{% if m.role != 'tool' and ns.in_outputs %}<｜tool▁outputs▁end｜>"
    "{% set ns.in_outputs = false %}{% endif %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<｜Assistant｜>{{ m.content or '' }}"
    "<｜tool▁calls▁begin｜>"
    "{% for tool in m.tool_calls %}<｜tool▁call▁begin｜>{{ tool.type }}<｜tool▁sep｜>"
    "{{ tool.function.name }}\n```json\n{{ tool.function.arguments }}\n```<｜tool▁call▁end｜>"
    "{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}"
    "{% if not ns.in_outputs %}<｜tool▁outputs▁begin｜>{% set ns.in_outputs = true %}"
    "{% endif %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% elif m.role != 'system' %}{{ raise_exception('unknown role ' + m.role) }}"
    "{% endif %}{% endfor %}"
    "{% if ns.in_outputs %}<｜tool▁outputs▁end｜>{% endif %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")

# --- GLM-4.5: tools as JSON in the system turn, calls as <arg_key>/<arg_value> pairs, results in
# an <|observation|> turn; enable_thinking=false closes an empty <think></think>.
GLM45 = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, output the function name and arguments within the following XML "
    "format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}"
    "{% elif m.role == 'assistant' %}<|assistant|>"
    "{% if m.reasoning_content %}{{ '\\n' }}<think>{{ m.reasoning_content }}</think>"
    "{% else %}{{ '\\n' }}<think></think>{% endif %}"
    "{% if m.content %}{{ '\\n' }}{{ m.content }}{% endif %}"
    "{% for tool_call in m.tool_calls or [] %}"
    "{% set tc = tool_call.function if tool_call.function is defined else tool_call %}"
    "\n<tool_call>{{ tc.name }}\n"
    "{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>"
    "{% endfor %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% else %}{{ raise_exception('unknown role ' + m.role) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '\\n' }}<think></think>{% endif %}"
    "{% endif %}")

_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>"]

# family: (template, special tokens, added (non-special) tokens, EOS tokens, BOS token)
FAMILIES = {
    "qwen3": (QWEN3, _QWEN_SPECIAL, _QWEN_ADDED, ["<|im_end|>", "<|endoftext|>"], None),
    "qwen3_next": (QWEN3_NEXT, _QWEN_SPECIAL, _QWEN_ADDED, ["<|im_end|>", "<|endoftext|>"],
                   None),
    "qwen3_8_flash_next": (QWEN38_FLASH_NEXT, _QWEN_SPECIAL, _QWEN_ADDED,
                           ["<|im_end|>", "<|endoftext|>"], None),
    "gpt_oss": (GPT_OSS, ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>",
                          "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                          "<|call|>"], [], ["<|return|>", "<|call|>", "<|endoftext|>"], None),
    "deepseek_v3": (DEEPSEEK_V3, ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                  "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
                                  "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                  "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                                  "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                                  "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
                    ["<think>", "</think>"], ["<｜end▁of▁sentence｜>"], "<｜begin▁of▁sentence｜>"),
    "glm45": (GLM45, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                      "<|observation|>", "<|endoftext|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
               "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"],
              ["<|user|>", "<|observation|>", "<|endoftext|>"], None),
}
