"""Response bodies shaped like OpenAI's: completions, chat completions, their stream chunks, usage.

finish_reason is the engine's: "stop", "length", or "abort" (vLLM's word for a sequence the server
stopped, e.g. at shutdown). With return_token_ids each choice (each chunk) carries `token_ids`, and
a choice's last chunk / the whole choice carries `prompt_token_ids`; `stop_reason` (vLLM's) says
which stop string or token ended a choice; `usage.prompt_tokens_details.cached_tokens` how many
prompt tokens the prefix cache held. With the server's --reasoning-parser, a chat reply's
thinking comes apart from its answer (qruntime.reasoning): `reasoning_content` beside `content` in
the message, and in stream deltas as it arrives.

Logprobs, when asked for: a chat choice's `logprobs.content` lists each generated token (its text,
logprob, UTF-8 `bytes` and `top_logprobs`), the thinking's tokens included; a completion choice's
`logprobs` holds OpenAI's legacy lists (`tokens`, `token_logprobs`, `top_logprobs` as {text:
logprob}, the likeliest of tokens that share a text, `text_offset` into the choice's text), its prompt's tokens first with `echo` (the first
one's logprob null). A stream chunk carries its own tokens'. Without the artifact's tokenizer a
token's text is "token_id:N".
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from qruntime.engine.outputs import RequestOutput, StreamDelta, TokenLogprob
from qruntime.reasoning import ReasoningSplitter, Split, split_reasoning
from qruntime.serve.protocol import GenerationRequest
from qruntime.tokenizer import TokenIdsOnly, Tokenizer
from qruntime.tool_calls import ToolCall, ToolCallStreamer, parse_tool_calls


class ResponseBuilder:
    """Builds one request's bodies; `chunk` for streaming, `full` for the whole response."""

    def __init__(
        self,
        request: GenerationRequest,
        request_id: str,
        model: str,
        created: int,
        tokenizer: Tokenizer | TokenIdsOnly | None = None,
    ) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self._offsets: dict[int, int] = {}  # completion choice -> characters of its text sent so far (text_offset)
        self._echoed: set[int] = set()  # stream choices whose prompt went out
        self._tool_streams: dict[int, ToolCallStreamer] = {}  # choice -> its stream's tool-call parser
        self._called: set[int] = set()  # stream choices that made a tool call
        self.head = {
            "id": request_id,
            "object": ("chat.completion" if request.chat else "text_completion"),
            "created": created,
            "model": model,
        }
        self._chunk_object = "chat.completion.chunk" if request.chat else "text_completion"
        self._splitters: dict[int, ReasoningSplitter] = {}  # choice -> its stream's thinking parser
        self._finished: dict[int, RequestOutput] = {}  # choice -> its output, as the stream ends it (for usage)

    def usage(self, completion_tokens: int, outputs: Mapping[int, RequestOutput]) -> dict[str, Any]:
        prompt_tokens = sum(self.request.prompt_lens)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self._cached_tokens(outputs)},
        }

    def _cached_tokens(self, outputs: Mapping[int, RequestOutput]) -> int:
        """Prompt tokens whose KV came from the prefix cache: per prompt, what its first choice found
        (a prompt's tokens count once in prompt_tokens, however many choices it has)."""
        first: dict[int, int] = {}
        for sequence in self.request.sequences:
            first.setdefault(sequence.prompt_index, sequence.index)
        return sum(outputs[i].num_cached_tokens for i in first.values() if i in outputs)

    def _choice(
        self,
        index: int,
        text: str | Split,
        output: RequestOutput | None,
        token_ids: tuple[int, ...],
        stream: bool,
        logprobs: Any = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """`text` is a Split (reasoning, answer) when the request returns the thinking apart;
        `logprobs` the choice's logprobs body (None: null); `tool_calls` the calls its answer made
        (then its finish_reason is "tool_calls" and an empty content is null)."""
        choice: dict[str, Any] = {"index": index}
        split = text if isinstance(text, Split) else None
        if self.request.chat and stream:
            if split is None:
                choice["delta"] = {"content": text} if text else {}
            else:
                delta = {"reasoning_content": split.reasoning, "content": split.content}
                choice["delta"] = {k: v for k, v in delta.items() if v}
            if tool_calls:
                choice["delta"]["tool_calls"] = tool_calls
        elif self.request.chat and split is None:
            choice["message"] = {"role": "assistant", "content": (text or None) if tool_calls else text}
        elif self.request.chat:  # vLLM's shape: null where there is none
            choice["message"] = {
                "role": "assistant",
                "content": split.content or None,
                "reasoning_content": split.reasoning or None,
            }
        else:
            choice["text"] = text
        if self.request.chat and not stream and tool_calls:
            choice["message"]["tool_calls"] = tool_calls
        choice["logprobs"] = logprobs
        choice["finish_reason"] = None if output is None else output.finish_reason
        if output is not None and (tool_calls or index in self._called):
            choice["finish_reason"] = "tool_calls"
        choice["stop_reason"] = None if output is None else output.stop_reason
        if self.request.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if output is not None:
                choice["prompt_token_ids"] = list(output.prompt_token_ids)
        return choice

    def _text(self, output_text: str) -> str | Split:
        if not self.request.reasoning:
            return output_text
        return split_reasoning(output_text, self.request.thinking_opened)

    def full(self, outputs: Mapping[int, RequestOutput]) -> dict[str, Any]:
        """The non-streaming body, from every choice's finished output (with best_of, every sequence's:
        the n best of each prompt become its choices)."""
        completion_tokens = sum(len(o.token_ids) for o in outputs.values())  # every sequence generated
        usage = self.usage(completion_tokens, outputs)
        choices = []
        for i, o in sorted(self._best(outputs).items()):
            text, logprobs = self._text(o.text), None
            first = None
            if self.request.echo:
                text = self._prompt_text(o.prompt_token_ids) + o.text
                entries, first = [*(o.prompt_logprobs or ())[1:], *(o.logprobs or ())], o.prompt_token_ids[0]
            else:
                entries = list(o.logprobs or ())
            if self.request.logprobs is not None:
                logprobs = self._logprobs(i, entries, first)
            calls = None
            if self.request.tools:
                content, parsed = parse_tool_calls(text.content if isinstance(text, Split) else text)
                if parsed:
                    parsed = parsed if self.request.parallel_tool_calls else parsed[:1]
                    calls = [_tool_call(call) for call in parsed]
                    text = Split(text.reasoning, content or "") if isinstance(text, Split) else (content or "")
            choices.append(self._choice(i, text, o, o.token_ids, stream=False, logprobs=logprobs, tool_calls=calls))
            if self.request.prompt_logprobs is not None and not self.request.chat:
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(o)
        body = {**self.head, "choices": choices, "usage": usage}
        if self.request.prompt_logprobs is not None and self.request.chat and outputs:
            body["prompt_logprobs"] = self._prompt_logprobs(next(iter(outputs.values())))  # one prompt: vLLM's place
        return body

    def _prompt_logprobs(self, output: RequestOutput) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} of the prompt's token and the k likeliest there."""
        k = self.request.prompt_logprobs or 0
        out: list[dict[str, Any] | None] = []
        for entry in output.prompt_logprobs or ():
            if entry is None:
                out.append(None)
                continue
            position = {
                str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": self._token(token_id)[0]}
                for rank, (token_id, logprob) in enumerate(entry.top[:k], start=1)
            }
            position[str(entry.token_id)] = {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": self._token(entry.token_id)[0],
            }
            out.append(position)
        return out

    def _best(self, outputs: Mapping[int, RequestOutput]) -> dict[int, RequestOutput]:
        """With best_of b > n: of each prompt's b sequences, the n with the highest mean token logprob,
        as its choices p * n .. p * n + n - 1 (best first; ties to the earlier sequence)."""
        n, runs = self.request.n, self.request.best_of
        if runs == n:
            return dict(outputs)
        best = {}
        for p in range(len(self.request.prompt_lens)):
            ranked = sorted(
                (i for i in range(p * runs, (p + 1) * runs) if i in outputs),
                key=lambda i: (-_mean_logprob(outputs[i]), i),
            )
            best.update((p * n + rank, outputs[i]) for rank, i in enumerate(ranked[:n]))
        return best

    def _stream_body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.head, "object": self._chunk_object, "choices": choices}

    def role_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant's role (and no content yet)."""
        if not self.request.chat:
            return []
        return [
            self._stream_body(
                [
                    {
                        "index": s.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for s in self.request.sequences
        ]

    def chunk(self, index: int, delta: StreamDelta) -> dict[str, Any] | None:
        """A stream chunk for one delta; None when it carries nothing a client would see."""
        text: str | Split = delta.text
        entries = list(delta.logprobs)
        if self.request.echo and index not in self._echoed:  # the prompt goes out first (streamed: no logprobs)
            self._echoed.add(index)
            sequence = next(s for s in self.request.sequences if s.index == index)
            text = self._prompt_text(sequence.prompt_ids) + delta.text
        if delta.output is not None:
            self._finished[index] = delta.output
        if self.request.reasoning:
            splitter = self._splitters.setdefault(index, ReasoningSplitter(self.request.thinking_opened))
            now = splitter.feed(delta.text)
            if delta.finished:
                last = splitter.flush()
                now = Split(now.reasoning + last.reasoning, now.content + last.content)
            text = now
        calls = None
        if self.request.tools:
            content, calls = self._stream_calls(
                index, text.content if isinstance(text, Split) else text, delta.finished
            )
            text = Split(text.reasoning, content) if isinstance(text, Split) else content
        visible = text.reasoning or text.content if isinstance(text, Split) else text
        if not (visible or delta.finished or (self.request.return_token_ids and delta.token_ids) or entries or calls):
            return None
        logprobs = self._logprobs(index, entries) if self.request.logprobs is not None else None
        return self._stream_body(
            [self._choice(index, text, delta.output, delta.token_ids, stream=True, logprobs=logprobs, tool_calls=calls)]
        )

    def _stream_calls(self, index: int, answer: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(the content of this part of a choice's answer, the tool-call deltas it makes): a call's
        first delta has its id, type and name (arguments "" or their start), later ones more of its
        arguments, as OpenAI streams them."""
        streamer = self._tool_streams.setdefault(index, ToolCallStreamer())
        content, pieces = streamer.feed(answer)
        if finished:
            content += streamer.finish()[0]
        calls: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.call and not self.request.parallel_tool_calls:
                continue  # the first call only
            if piece.name is not None:
                self._called.add(index)
                calls.append({"index": piece.call, **_tool_call(ToolCall(piece.name, piece.arguments))})
            elif calls and calls[-1]["index"] == piece.call:  # joined with this chunk's delta of the same call
                calls[-1]["function"]["arguments"] += piece.arguments
            else:
                calls.append({"index": piece.call, "function": {"arguments": piece.arguments}})
        return content, calls

    # --- logprobs ---------------------------------------------------------------------------------
    def _prompt_text(self, prompt_ids: tuple[int, ...]) -> str:
        if self.tokenizer is None or not self.tokenizer.has_text:
            return ""
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def _token(self, token_id: int) -> tuple[str, bytes | None]:
        if self.tokenizer is None or not self.tokenizer.has_text:
            return f"token_id:{token_id}", None
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def _logprobs(self, index: int, entries: list[TokenLogprob], first: int | None = None) -> dict[str, Any]:
        """A choice's logprobs body for `entries`; `first`: an echoed prompt's first token, which has none."""
        if self.request.chat:
            content = []
            for entry in entries:
                text, raw = self._token(entry.token_id)
                top = []
                for token_id, logprob in entry.top:
                    top_text, top_raw = self._token(token_id)
                    top.append(
                        {"token": top_text, "logprob": logprob, "bytes": None if top_raw is None else list(top_raw)}
                    )
                content.append(
                    {
                        "token": text,
                        "logprob": entry.logprob,
                        "bytes": None if raw is None else list(raw),
                        "top_logprobs": top,
                    }
                )
            return {"content": content}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        if first is not None:
            text, _ = self._token(first)
            tokens.append(text)
            token_logprobs.append(None)
            top_logprobs.append(None)
            offsets.append(offset)
            offset += len(text)
        for entry in entries:
            text, _ = self._token(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for token_id, logprob in entry.top:  # tokens of one text (pieces of a character: U+FFFD) keep the likeliest
                top.setdefault(self._token(token_id)[0], logprob)
            top_logprobs.append(top if self.request.logprobs else None)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._stream_body([]), "usage": self.usage(completion_tokens, self._finished)}


def _mean_logprob(output: RequestOutput) -> float:
    """The mean logprob of a sequence's tokens (-inf for one without any)."""
    entries = output.logprobs or ()
    return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")


def _tool_call(call: ToolCall) -> dict[str, Any]:
    """A call as OpenAI's tool_calls entry (a fresh id: the model does not name its calls)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
