"""The output parser of formats that mark regions with tags: text, a reasoning region between
`think` tags, and tool-call regions between `call` tags whose body a format parses."""

from __future__ import annotations

from cupool.serve.formats import Piece, lcp_hold


class TagParser:
    """States: "text" (content), "reasoning", "call" (a tool-call region, held until it ends).

    think: (start, end) tags of reasoning, or None. call: (start, end) tags of a tool-call
    region, or None (tool calls not parsed). parse_body(body) -> [ToolCall] or None where the
    body is not a call. `reasoning`: the generation starts inside the reasoning region (its
    start tag ended the prompt)."""

    def __init__(self, think, call, parse_body, reasoning: bool = False):
        self.think, self.call, self.parse_body = think, call, parse_body
        self.state = "reasoning" if reasoning and think else "text"
        self.buf = ""
        self.after_think = False       # drop the whitespace after reasoning or a call
        self.in_think = False          # past the newlines that follow the start of reasoning

    def _starts(self):
        return [t for t in ((self.think[0] if self.think else None),
                            (self.call[0] if self.call else None)) if t]

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf:
            if self.state == "text":
                if self.after_think:
                    stripped = self.buf.lstrip()
                    if not stripped:
                        self.buf = ""
                        break
                    self.buf, self.after_think = stripped, False
                hits = [(i, t) for t in self._starts() if (i := self.buf.find(t)) >= 0]
                if hits:
                    i, tag = min(hits)
                    if i:
                        out.append(Piece("content", self.buf[:i]))
                    self.buf = self.buf[i + len(tag):]
                    self.state = "reasoning" if self.think and tag == self.think[0] else "call"
                    continue
                keep = lcp_hold(self.buf, self._starts())
                if len(self.buf) > keep:
                    out.append(Piece("content", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.state == "reasoning":
                if not self.in_think:                    # newlines after the start tag: layout
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        break
                    self.in_think = True
                end = self.think[1]
                i = self.buf.find(end)
                if i >= 0:
                    text = self.buf[:i].rstrip("\n")      # and before the end tag
                    if text:
                        out.append(Piece("reasoning", text))
                    self.buf = self.buf[i + len(end):]
                    self.state, self.after_think, self.in_think = "text", True, False
                    continue
                keep = lcp_hold(self.buf, [end])
                rest = self.buf[:len(self.buf) - keep]
                keep += len(rest) - len(rest.rstrip("\n"))
                if len(self.buf) > keep:
                    out.append(Piece("reasoning", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                break
            start, end = self.call                          # state "call"
            i = self.buf.find(end)
            if i < 0:
                break                                       # a call is released whole
            body, self.buf = self.buf[:i], self.buf[i + len(end):]
            self.state, self.after_think = "text", True
            out += self._call(start, body, end)
        return out

    def _call(self, start: str, body: str, end: str) -> list[Piece]:
        try:
            calls = self.parse_body(body)
        except (ValueError, TypeError, KeyError, AttributeError):
            calls = None
        if not calls:
            return [Piece("content", start + body + end)]      # not a call: the model's text
        return [Piece("tool", call=c) for c in calls]

    def finish(self) -> list[Piece]:
        """The rest, at the end of the generation: an unfinished call is text."""
        out = []
        if self.state == "call":
            out.append(Piece("content", self.call[0] + self.buf))
        elif self.buf and not (self.state == "text" and self.after_think
                               and not self.buf.strip()):
            text = self.buf.rstrip("\n") if self.state == "reasoning" else self.buf
            if text:
                out.append(Piece("reasoning" if self.state == "reasoning" else "content", text))
        self.buf = ""
        return out
