"""The engines' KV-cache events: which rank holds which block, as the engines say.

``wire`` decodes vLLM's and SGLang's frames, ``keys`` chains blocks by their token ids,
``index`` keeps which rank holds which key, ``subscriber`` follows one rank's
publisher, ``feed`` starts and stops subscribers as workers come and go, and
``prompt`` turns a request into the keys of its blocks.
"""
