"""Reasoning ("thinking") output split from the answer: ``<think>...</think>`` (or the model's own markers) becomes
the message's ``reasoning_content``, the rest its ``content``, streamed or not.

A reply is reasoning from the start marker, when the marker opens it (nothing but whitespace before), or from the
start when the prompt already opened it (a chat template that ends with ``<think>``), up to the end marker; after
it (leading newlines dropped) everything is content, further markers included. Without an end marker the whole
reply is reasoning. Streaming holds back only the text that could still be the beginning of a marker, so the
deltas always add up to the non-streamed split.
"""

from __future__ import annotations

import copy

# (start, end) markers of the reasoning models' formats, looked for in the tokenizer's tokens and the chat template
KNOWN_MARKERS = (
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("\u25c1think\u25b7", "\u25c1/think\u25b7"),
)


def model_markers(tok, template=None) -> tuple[str, str] | None:
    """The reasoning markers this model names: a pair that is two tokens of its vocabulary, or that its chat
    template (``template``, default the model's own) writes; None when it names none."""
    template = tok.chat_template if template is None else template
    text = template if isinstance(template, str) else str(template or "")
    for start, end in KNOWN_MARKERS:
        if tok.token_to_id(start) is not None and tok.token_to_id(end) is not None:
            return start, end
    for start, end in KNOWN_MARKERS:
        if start in text and end in text:
            return start, end
    return None


def opens_reasoning(prompt: str, start: str) -> bool:
    """Whether the rendered prompt ends inside a reasoning block: it ends with a start marker (whitespace after it
    allowed), as templates that open the model's reasoning for it do."""
    i = prompt.rfind(start)
    return i >= 0 and not prompt[i + len(start) :].strip()


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Feed the reply's text as it comes (:meth:`push`), then :meth:`flush`; each returns (reasoning, content)
    to emit now."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end = start, end
        # "before": nothing but whitespace yet; "reasoning"; "after": past the end marker; "content": no reasoning
        self.state = "reasoning" if inside else "before"
        self.pending = ""
        self.skip_newlines = False

    def push(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == "before":
                stripped = self.pending.lstrip()
                if not stripped:
                    break  # whitespace only so far: it may still precede a start marker
                if stripped.startswith(self.start):
                    self.pending = stripped[len(self.start) :]
                    self.state = "reasoning"
                    continue
                if self.start.startswith(stripped):
                    break  # could still become the start marker
                self.state = "content"
                continue
            if self.state == "reasoning":
                i = self.pending.find(self.end)
                if i >= 0:
                    reasoning.append(self.pending[:i])
                    self.pending = self.pending[i + len(self.end) :]
                    self.state, self.skip_newlines = "after", True
                    continue
                keep = _held(self.pending, self.end)
                reasoning.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            # after the reasoning, or a reply without any: all content
            if self.skip_newlines:
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.skip_newlines = False
            content.append(self.pending)
            self.pending = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The end of the reply: what was held back."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            return rest, ""
        if self.state == "after" and self.skip_newlines:
            rest = rest.lstrip("\n")
        return "", rest


def split(text: str, start: str, end: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning_content or None when the reply has none, content) of a whole reply."""
    s = ReasoningSplitter(start, end, inside)
    r1, c1 = s.push(text)
    r2, c2 = s.flush()
    had = s.state in ("reasoning", "after")
    return (r1 + r2 if had else None), c1 + c2


class ReasoningBudget:
    """A token constraint (``Engine.submit(constraint=...)``) that ends the reasoning after ``budget`` tokens of
    it: from there the job may only write ``forced`` (the budget message and the end marker), one token at a time;
    then nothing is constrained. Before that every token is allowed, so the output is the unbudgeted one up to the
    cut. Whether the reply opens a reasoning block and where it ends is read from the text of its tokens."""

    def __init__(self, tok, vocab: int, start: str, end: str, inside: bool, budget: int, message: str = ""):
        self.tok, self.words = tok, (vocab + 31) // 32
        self.start, self.end, self.budget = start, end, budget
        self.forced = tok.encode(message + end, add_bos=False)
        self.state = "reasoning" if inside else "before"
        self.count = 0
        self.queue: list[int] = []
        self.text = ""  # the reply so far while it is before or in its reasoning
        self.ids: list[int] = []

    def _only(self, token: int) -> list[int]:
        words = [0] * self.words
        words[token // 32] = 1 << (token % 32)
        return words

    def _force(self) -> list[int]:
        self.state = "forcing"
        self.queue = list(self.forced)
        return self._only(self.queue[0])

    def mask(self) -> list[int]:
        if self.state == "reasoning" and self.budget <= 0:
            return self._force()
        return []

    def draft_masks(self, drafts: list[int]) -> list[list[int]]:
        """The masks after drafts[0], drafts[:2], ... (what ``advance`` would return for each in turn; [] where every
        token is allowed), stopping at the first draft the mask before it forbids. This state is not changed."""
        sim = copy.copy(self)
        sim.queue, sim.ids = list(self.queue), list(self.ids)
        allowed = sim._only(sim.queue[0]) if sim.state == "forcing" else []
        out: list[list[int]] = []
        for t in drafts:
            t = int(t)
            if allowed and not (0 <= t < len(allowed) * 32 and allowed[t >> 5] >> (t & 31) & 1):
                break
            allowed = sim.advance(t)
            out.append(allowed)
        return out

    def advance(self, token: int) -> list[int]:
        if self.state == "forcing":
            self.queue.pop(0)
            if self.queue:
                return self._only(self.queue[0])
            self.state = "done"
            return []
        if self.state == "done":
            return []
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        if self.state == "before":
            head = text.lstrip()
            if head.startswith(self.start):
                self.state, self.ids, self.count = "reasoning", [], 0
                return self._force() if self.budget <= 0 else []
            if head and not self.start.startswith(head):
                self.state = "done"  # no reasoning in this reply
            return []
        self.count += 1
        if self.end in text:
            self.state = "done"
            return []
        if len(self.ids) > 64:  # only the tail can still hold the end marker
            self.ids = self.ids[-16:]
        return self._force() if self.count >= self.budget else []
