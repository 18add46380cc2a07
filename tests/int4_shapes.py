"""The small Qwen3 shapes the int4 tests build their checkpoints with (a helper module at tests/,
importable from every test folder as the rootdir conftest puts tests/ on sys.path): hidden 128,
q 4 x 64 = 256, kv 2 x 64, intermediate 256, so every K is a multiple of the int4 group (128), also
per rank at tp=2."""

INT4_SHAPES = {
    "hidden_size": 128,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
}
