"""The cluster tests' prompts, one list, so transformers' references are computed once a
session (tests/reference.py caches them by prompt and length)."""

PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(3 + i % 11)] for i in range(32)]
MAX_TOKENS = 8
