"""The ground floor: errors in the OpenAI shape and every exception, the shared types,
headers, and small utilities (listening sockets, the tokenizer). Imports nothing of ours."""
