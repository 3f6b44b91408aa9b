"""The worker runtime: the Celery bootstep that hosts one engine per process, and its glue to Redis."""
