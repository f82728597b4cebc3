"""The server's fixed limits and defaults, in a module of their own so that the command line can name them
without the server extra installed."""

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
DEFAULT_MAX_TOKENS = 4096  # a chat request without max_tokens generates at most this many
MAX_TOKENS_WITHOUT_WINDOW = 32768  # the context length of a model whose config states none
GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (as vLLM does)
