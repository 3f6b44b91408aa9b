"""Celery's Redis result backend, storing a task's result in one round trip.

Celery's `_store_result` first GETs the stored result (so that a duplicate run cannot overwrite a
SUCCESS), decodes it, then sets the new one and publishes it in a MULTI/EXEC: two round trips and
four commands per task, a sizeable share of the worker's CPU for a short job. Here one script does the
same check and writes, atomically (Celery's check and set could race). Results are stored and
published exactly as Celery's own backend does (same key, value, expiry and channel), so any Celery
app reads them with the stock backend.
"""

from __future__ import annotations

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

# KEYS: the result's key. ARGV: the encoded result, its expiry in seconds (0: none).
# Returns 1 stored, 0 a SUCCESS already stored (kept), -1 a stored value the script cannot read.
STORE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, meta = pcall(cjson.decode, cur)
  if not ok or type(meta) ~= 'table' then return -1 end
  if meta.status == 'SUCCESS' then return 0 end
end
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
"""
UNREADABLE = -1


class OneTripStore:
    """Mixed into a RedisBackend class (`one_trip`): only the store of a task's result changes."""

    _store_script = None

    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        expires = self.expires
        if state == states.FAILURE:  # Celery 5.6 has no result_failure_expires: the default (goes with 5.6)
            expires = getattr(self, "failure_expires", self.expires)
        stored = self.ensure(self._store_once, (self.get_key_for_task(task_id), value, expires or 0))
        if stored == UNREADABLE:  # compressed or foreign: Celery's own check decodes it
            return super()._store_result(task_id, result, state, traceback, request, **kwargs)
        return result

    def _store_once(self, key, value, expires) -> int:
        if self._store_script is None:
            self._store_script = self.client.register_script(STORE)
        return int(self._store_script(keys=[key], args=[value, int(expires)]))


def one_trip(backend_cls: type) -> type:
    """`backend_cls` with results stored in one round trip when it is Celery's Redis backend (or one
    of its kind: Sentinel's), else unchanged."""
    if not isinstance(backend_cls, type) or not issubclass(backend_cls, RedisBackend):
        return backend_cls
    return type(backend_cls.__name__, (OneTripStore, backend_cls), {"__module__": __name__})
