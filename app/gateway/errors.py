"""Errors the gateway answers with: each becomes a 4xx/5xx JSON body naming the field."""

from __future__ import annotations


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        kind: str = "invalid_request_error",
        retry_after: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.field, self.kind = status, message, field, kind
        self.retry_after = retry_after


class JobError(Exception):
    """The worker refused or failed the job (its stream's error entry): a 400 when a field is named."""

    def __init__(self, fields: dict[str, str]) -> None:
        super().__init__(fields.get("message", "error"))
        self.field = fields.get("field") or None

    @property
    def status(self) -> int:
        return 400 if self.field else 500
