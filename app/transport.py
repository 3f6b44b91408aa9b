"""kombu's Redis transport, made to survive a Redis crash inside a long-lived worker.

After a broker reconnect Celery's consumer gets a new channel, but tasks that were running keep
their messages from the old one, whose connection is gone. Acking (or rejecting) such a message
raised AttributeError deep in kombu, which Celery treats as unrecoverable: the worker stopped
consuming for good. Here an ack on a stale channel is done directly in Redis instead (the same two
deletions kombu would make), and a reject requeues the message the same way.

The restore of unacked messages when a channel closes is off as well: it failed the same way, and
weightq does not need it (a job that must stop goes back with Reject; anything else left unacked is
restored by the visibility sweep of whichever worker runs next).
"""

from __future__ import annotations

import logging

import redis
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)


def _fresh_client() -> redis.Redis:
    from .settings import Settings

    return redis.Redis.from_url(Settings.from_env().resolved_redis_url(), socket_timeout=10)


class Channel(kombu_redis.Channel):
    do_restore = False

    def basic_ack(self, delivery_tag, multiple=False):
        try:
            return super().basic_ack(delivery_tag, multiple)
        except AttributeError:  # a stale channel: its connection went with the old broker connection
            log.warning("acking %s outside its stale channel", delivery_tag)
            pipe = _fresh_client().pipeline()
            pipe.zrem(self.unacked_index_key, delivery_tag)
            pipe.hdel(self.unacked_key, delivery_tag)
            pipe.execute()

    def basic_reject(self, delivery_tag, requeue=False):
        try:
            return super().basic_reject(delivery_tag, requeue)
        except AttributeError:
            log.warning("rejecting %s outside its stale channel (requeue=%s)", delivery_tag, requeue)
            client = _fresh_client()
            raw = client.hget(self.unacked_key, delivery_tag)
            pipe = client.pipeline()
            if requeue and raw is not None:
                message, _, routing_key = kombu_redis.loads(raw)
                pipe.lpush(routing_key, kombu_redis.dumps(message))  # the default exchange: key = queue
            pipe.zrem(self.unacked_index_key, delivery_tag)
            pipe.hdel(self.unacked_key, delivery_tag)
            pipe.execute()


class Transport(kombu_redis.Transport):
    Channel = Channel
