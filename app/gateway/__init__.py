"""The HTTP gateway: OpenAI and TGI routes in front of the job queue (`weightq gateway`)."""

from .app import create_app

__all__ = ["create_app"]
