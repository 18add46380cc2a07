"""Stop strings found in streamed text at a cost of O(new text), however many stop strings there are.

An Aho-Corasick automaton over the stop strings, fed the output text as it is released. Its state is
the longest end of the text so far that begins some stop string, which is also how much text must be
held back (it may yet become a stop string). A stop string completes when the state reaches a node
whose string ends with one; the first such position wins, and of the stop strings ending there, the
longest (the one starting first). Building costs O(total length of the stop strings).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    """Feed text with `feed`; `held` is how many of the last characters fed may begin a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop strings must be a non-empty list of non-empty strings")
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        longest = [0]  # the longest stop string ending at this node's string (0: none)
        for stop in stops:
            node = 0
            for ch in stop:
                if ch not in goto[node]:
                    goto.append({})
                    depth.append(depth[node] + 1)
                    longest.append(0)
                    goto[node][ch] = len(goto) - 1
                node = goto[node][ch]
            longest[node] = len(stop)
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:  # breadth first: a node's failure link is final before its children need it
            node = queue.popleft()
            longest[node] = max(longest[node], longest[fail[node]])
            for ch, child in goto[node].items():
                link = fail[node]
                while link and ch not in goto[link]:
                    link = fail[link]
                fail[child] = goto[link].get(ch, 0)
                queue.append(child)
        self._goto, self._fail, self._depth, self._longest = goto, fail, depth, longest
        self._state = 0

    @property
    def held(self) -> int:
        """Length of the longest end of the text fed so far that begins some stop string."""
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Take `text`; at the first stop string completed, return (end, length): it is
        text[end - length:end] when it lies within `text`, and may begin up to `held` characters
        (as it was before this call) earlier. None when no stop string completes."""
        goto, fail, longest = self._goto, self._fail, self._longest
        state = self._state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if longest[state]:
                self._state = state
                return i + 1, longest[state]
        self._state = state
        return None
