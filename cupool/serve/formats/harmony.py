"""gpt-oss's harmony format: the output is a sequence of messages, each a header and a body,

    [<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>

with the recipient possibly written before <|channel|>. The `analysis` channel is reasoning,
`final` is the answer (content), `commentary` is content unless addressed to a function
(`to=functions.NAME`): then its body is that call's JSON arguments. A generation ends at
<|return|> (after the final message) or <|call|> (after a call); both are EOS ids, so the last
message's body runs to the end of the text."""

from __future__ import annotations

import json
import re

from cupool.serve.formats import ChatFormat, Piece, ToolCall, lcp_hold

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, START, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyParser:
    def __init__(self, tools: bool):
        self.tools = tools
        self.state, self.buf, self.header = "header", "", ""
        self.kind, self.function, self.body = "content", None, ""

    def _open(self, header: str) -> None:
        m = _CHANNEL.search(header)
        channel = m.group(1) if m else ""
        to = _RECIPIENT.search(header)
        recipient = to.group(1) if to else ""
        self.function = None
        if channel == "analysis":
            self.kind = "reasoning"
        elif recipient.startswith("functions.") and self.tools:
            self.kind, self.function = "call", recipient[len("functions."):]
        else:
            self.kind = "content"

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf:
            if self.state == "header":
                i = self.buf.find(MESSAGE)
                if i < 0:
                    break
                self.header, self.buf = self.buf[:i], self.buf[i + len(MESSAGE):]
                self._open(self.header)
                self.state, self.body = "body", ""
                continue
            hits = [(i, m) for m in BODY_ENDS if (i := self.buf.find(m)) >= 0]
            if hits:
                i, marker = min(hits)
                out += self._body(self.buf[:i], final=True)
                self.buf = self.buf[i + len(marker):]
                self.state = "header"
                if marker == START:
                    continue
                j = self.buf.find(START)                 # text between messages: dropped
                self.buf = self.buf[j + len(START):] if j >= 0 else ""
                continue
            keep = lcp_hold(self.buf, BODY_ENDS)
            out += self._body(self.buf[:len(self.buf) - keep], final=False)
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def _body(self, text: str, final: bool) -> list[Piece]:
        if self.kind != "call":
            return [Piece(self.kind, text)] if text else []
        self.body += text
        if not final:
            return []                                    # a call is released whole
        try:
            args = json.loads(self.body)
        except ValueError:
            args = None
        if not isinstance(args, dict) or not self.function:
            return [Piece("content", self.body)]
        return [Piece("tool", call=ToolCall(self.function,
                                            json.dumps(args, ensure_ascii=False)))]

    def finish(self) -> list[Piece]:
        if self.state == "header":
            out = [Piece("content", self.buf)] if self.buf.strip() else []
        else:
            out = self._body(self.buf, final=True)
        self.buf = ""
        return out


class Harmony(ChatFormat):
    name = "harmony"
    markers = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)

    def parser(self, prompt_text: str, tools):
        return HarmonyParser(bool(tools))

    def opener(self, name: str | None) -> str:
        if name is None:
            return CHANNEL + "commentary to=functions."
        return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"
