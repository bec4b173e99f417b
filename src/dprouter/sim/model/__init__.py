"""The engine model, in virtual time and with no I/O: ranks, their queues and batches,
prefix caches, how an engine places a request, what each step costs."""
