"""Response bodies shaped like OpenAI's: completions, chat completions, their stream chunks, usage.

finish_reason is the engine's: "stop", "length", or "abort" (vLLM's word for a sequence the server
stopped, e.g. at shutdown). With return_token_ids each choice (each chunk) carries `token_ids`, and
a choice's last chunk / the whole choice carries `prompt_token_ids`; `stop_reason` (vLLM's) says
which stop string or token ended a choice; `usage.prompt_tokens_details.cached_tokens` how many
prompt tokens the prefix cache held. With the server's --reasoning-parser, a chat reply's
thinking comes apart from its answer (qruntime.reasoning): `reasoning_content` beside `content` in
the message, and in stream deltas as it arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qruntime.engine.outputs import RequestOutput, StreamDelta
from qruntime.reasoning import ReasoningSplitter, Split, split_reasoning
from qruntime.serve.protocol import GenerationRequest


class ResponseBuilder:
    """Builds one request's bodies; `chunk` for streaming, `full` for the whole response."""

    def __init__(self, request: GenerationRequest, request_id: str, model: str, created: int) -> None:
        self.request = request
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
    ) -> dict[str, Any]:
        """`text` is a Split (reasoning, answer) when the request returns the thinking apart."""
        choice: dict[str, Any] = {"index": index}
        split = text if isinstance(text, Split) else None
        if self.request.chat and stream:
            if split is None:
                choice["delta"] = {"content": text} if text else {}
            else:
                delta = {"reasoning_content": split.reasoning, "content": split.content}
                choice["delta"] = {k: v for k, v in delta.items() if v}
        elif self.request.chat and split is None:
            choice["message"] = {"role": "assistant", "content": text}
        elif self.request.chat:  # vLLM's shape: null where there is none
            choice["message"] = {
                "role": "assistant",
                "content": split.content or None,
                "reasoning_content": split.reasoning or None,
            }
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = None if output is None else output.finish_reason
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
        """The non-streaming body, from every choice's finished output."""
        choices = [self._choice(i, self._text(o.text), o, o.token_ids, stream=False) for i, o in sorted(outputs.items())]
        completion_tokens = sum(len(o.token_ids) for o in outputs.values())
        return {**self.head, "choices": choices, "usage": self.usage(completion_tokens, outputs)}

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
        if delta.output is not None:
            self._finished[index] = delta.output
        if self.request.reasoning:
            splitter = self._splitters.setdefault(index, ReasoningSplitter(self.request.thinking_opened))
            now = splitter.feed(delta.text)
            if delta.finished:
                last = splitter.flush()
                now = Split(now.reasoning + last.reasoning, now.content + last.content)
            text = now
        visible = text.reasoning or text.content if isinstance(text, Split) else text
        if not (visible or delta.finished or (self.request.return_token_ids and delta.token_ids)):
            return None
        return self._stream_body([self._choice(index, text, delta.output, delta.token_ids, stream=True)])

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._stream_body([]), "usage": self.usage(completion_tokens, self._finished)}
