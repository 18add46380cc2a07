"""Speculative decoding: a draft proposes tokens, one target step verifies them (config: the method
and its limits; proposers: the draft methods, by name; rejection: the verification that keeps the
target's distribution; draft_length: adaptive k; speculator: what the engine holds)."""
