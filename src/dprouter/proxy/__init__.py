"""The request path: read a request, choose its pool and target, attempt it (retrying
elsewhere by one set of rules), relay the answer. Plain, P/D (``pd``) and rankless
requests are flows over the same steps."""
