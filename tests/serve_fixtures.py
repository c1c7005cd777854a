"""Fixtures for the `cupool.serve` tests: a tiny model directory written the way published ones are
(config.json, model.safetensors, generation_config.json, tokenizer files with a chat template),
and a live server on 127.0.0.1 running in a background thread.

The tokenizer is built here with the `tokenizers` library, so nothing is downloaded: one token per
character over a fixed alphabet (lower-cased input), eight special tokens, and a decoder that
concatenates the characters. Its 64 ids match the tiny model's vocabulary.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import torch

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, BOS, EOS, UNK, END = 0, 1, 2, 3, 7
ALPHABET = " abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"-:;()[]/+=*#\n"  # 56 characters
VOCAB = len(SPECIAL) + len(ALPHABET)
assert VOCAB == 64, VOCAB

# Knows three roles and refuses others through `raise_exception` (as published templates do).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception(\"this chat template knows the roles system, user and assistant, not '\""
    " + message['role'] + \"'\") -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

MODEL_CONFIG = {"vocab_size": VOCAB, "hidden_size": 48, "head_dim": 16, "intermediate_size": 64,
                "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                "max_position_embeddings": 256, "pad_token_id": PAD, "bos_token_id": BOS,
                "eos_token_id": EOS}


def build_tokenizer():
    """The character-level `PreTrainedTokenizerFast` of the tiny model (64 ids, a chat template)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(ALPHABET))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>",
                                  additional_special_tokens=SPECIAL[4:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_tiny_model(directory, *, tokenizer: bool = True, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen3-MoE (2 layers, 8 experts, 64 ids) with
    save_pretrained into `directory`, plus the tokenizer unless `tokenizer` is False. EOS ids
    are "</s>" and "<|end|>" (generation_config.json). Returns the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    directory = Path(directory)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **MODEL_CONFIG),
                                             dtype=torch.float32)
    with torch.no_grad():
        for m in model.modules():             # fused experts are left as allocated: fill them
            if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor):
                m.gate_up_proj.normal_(0, 0.2)
                m.down_proj.normal_(0, 0.2)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, END],
                                               pad_token_id=PAD)
    model.save_pretrained(directory)
    if tokenizer:
        build_tokenizer().save_pretrained(directory)
    return directory


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`cupool.serve` on 127.0.0.1 in a background thread: the model of `model_dir` loaded on the
    CPU, one started Engine, the FastAPI app under uvicorn on a free port.

    Attributes: base_url ("http://127.0.0.1:PORT/v1"), engine, tokenizer, app, model_name.
    `close()` stops uvicorn (as SIGTERM does: open requests may finish for up to
    `shutdown_timeout` s), then the engine. Other keywords go to `create_app`.
    """

    def __init__(self, model_dir, *, max_batch: int = 8, max_len: int = 128,
                 model_name: str = "tiny-moe", shutdown_timeout: float | None = None,
                 engine_kwargs: dict | None = None, **app_kwargs):
        import uvicorn

        from cupool.engine import Engine
        from cupool.serve.app import create_app
        from cupool.serve.loader import load

        model, pool, self.tokenizer = load(model_dir, "cpu", max_batch=max_batch, max_len=max_len)
        self.engine = Engine(model, pool, tokenizer=self.tokenizer, max_batch=max_batch,
                             max_len=max_len, **(engine_kwargs or {}))
        self.engine.start()
        self.model_name = model_name
        self.app = create_app(self.engine, self.tokenizer, model_name, **app_kwargs)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=shutdown_timeout)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def busy_slots(self) -> int:
        """Slots of the engine that hold a request, plus requests queued for one."""
        eng = self.engine
        return sum(r is not None for r in eng._slots) + len(eng._pending) + eng._incoming.qsize()

    def wait_idle(self, timeout: float = 10.0) -> int:
        """Wait until the engine holds no request (or the timeout); returns the busy count."""
        deadline = time.monotonic() + timeout
        while (busy := self.busy_slots()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return busy

    def close(self, timeout: float = 10) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=timeout)
        self._sock.close()
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sse_data(lines) -> list[str]:
    """The `data:` payloads of a server-sent event stream, from its lines, in order."""
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


class Forced:
    """A token-mask constraint (`Engine.submit(..., constraint=)`) that allows exactly the
    tokens of `script`, in order, then ends the request: the engine emits that sequence whatever
    the model's logits say. A scripted "model" for tests of what the server makes of a model's
    output (tool calls, reasoning), run through the real sampling step and token mask."""

    def __init__(self, script: list[int]):
        if not script:
            raise ValueError("script is empty")
        self.script, self.at = list(script), 0

    def fill(self, words) -> None:
        words.zero_()
        t = self.script[min(self.at, len(self.script) - 1)]
        words[t // 32] = (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)   # int32 bit

    def accept(self, token: int) -> None:
        if self.at < len(self.script) and token == self.script[self.at]:
            self.at += 1

    def done(self) -> bool:
        return self.at >= len(self.script)


# --- tokenizers and models of the chat-format families (tests/chat_templates.py) ------------------
FAMILY_VOCAB = 128
FAMILY_CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))   # 97 characters
FAMILY_SLOTS = FAMILY_VOCAB - len(FAMILY_CHARS)                    # ids of special/added tokens


def build_family_tokenizer(family: str):
    """A byte-level BPE tokenizer, as the families' own are, without merges: every printable
    ASCII character one token (case kept), with `family`'s special and added tokens and chat
    template, 128 ids."""
    from chat_templates import FAMILIES
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, special, added, _eos, bos = FAMILIES[family]
    marks = ["<pad>", "<unk>"] + special + added
    if len(marks) > FAMILY_SLOTS:
        raise ValueError(f"{family}: {len(marks)} special tokens, room for {FAMILY_SLOTS}")
    marks += [f"<|reserved_{i}|>" for i in range(FAMILY_SLOTS - len(marks))]
    byte_char = pre_tokenizers.ByteLevel.alphabet()       # the 256 byte characters
    visible = {b: c for b, c in _bytes_to_unicode().items() if c in byte_char}
    vocab = {tok: i for i, tok in enumerate(marks + [visible[ord(ch)] for ch in FAMILY_CHARS])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t in ["<pad>", "<unk>"] + special])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  bos_token=bos, eos_token=_eos[0],
                                  additional_special_tokens=special)
    tok.chat_template = template
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map of byte-level BPE: printable bytes stand for themselves,
    the others are shifted past 255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def write_family_model(directory, family: str, *, seed: int = 0,
                       model_type: str = "qwen3_moe") -> Path:
    """The tiny Qwen3-MoE of `write_tiny_model` (or, with `model_type`, the tiny model of that
    hybrid family of tests/tiny_models.py) with 128 ids and `family`'s tokenizer, chat template
    and EOS ids (generation_config.json)."""
    from chat_templates import FAMILIES
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    directory = Path(directory)
    tok = build_family_tokenizer(family)
    eos = [tok.convert_tokens_to_ids(t) for t in FAMILIES[family][3]]
    torch.manual_seed(seed)
    if model_type == "qwen3_moe":
        base = MODEL_CONFIG
    else:
        from tiny_models import HYBRID_FAMILIES
        base = dict(HYBRID_FAMILIES[model_type][0], initializer_range=0.15)
    cfg = dict(base, vocab_size=FAMILY_VOCAB, max_position_embeddings=2048,
               eos_token_id=eos[0], pad_token_id=0,
               bos_token_id=None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg),
                                             dtype=torch.float32)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor):
                m.gate_up_proj.normal_(0, 0.2)
                m.down_proj.normal_(0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


class Scripted:
    """Makes `engine` emit scripted outputs: each submitted request takes the next script of
    `push(text)` (its tokens, then `eos`), through the `Forced` constraint. The prompts the
    engine was given are kept in `prompts`."""

    def __init__(self, engine, tokenizer, eos: int):
        self.tokenizer, self.eos = tokenizer, eos
        self.scripts: list[list[int]] = []
        self.prompts: list[list[int]] = []
        real = engine.submit

        def submit(ids, params=None, on_event=None, constraint=None, **kwargs):
            self.prompts.append(list(ids))
            if self.scripts:
                constraint = Forced(self.scripts.pop(0))
            return real(ids, params, on_event, constraint, **kwargs)
        engine.submit = submit

    def push(self, text: str, eos: bool = True) -> None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.tokenizer.decode(ids) != text:
            raise ValueError(f"the test tokenizer does not round-trip {text!r}")
        self.scripts.append(ids + ([self.eos] if eos else []))

    def prompt_text(self, k: int = -1) -> str:
        return self.tokenizer.decode(self.prompts[k])
