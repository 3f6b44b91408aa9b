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

from .redis_conn import FailoverAwareConnection, is_transient

log = logging.getLogger(__name__)


def _fresh_client() -> redis.Redis:
    from .redis_conn import connect
    from .settings import Settings

    s = Settings.from_env()
    return connect(s.resolved_redis_url(), s, socket_timeout=10)


class StaleChannelSafe:
    """The ack and reject of a message whose channel went with an old broker connection."""

    do_restore = False

    def _brpop_read(self, **options):
        # BRPOP is a write: a master that lost its replicas (min-replicas-to-write) answers
        # NOREPLICAS, and a demoted one READONLY. Celery stops its consumer for good on a ResponseError
        # but reconnects after a connection error, which (under Sentinel) finds the new master.
        try:
            return super()._brpop_read(**options)
        except redis.ResponseError as e:
            if not is_transient(e):
                raise
            self.client.connection.disconnect()
            raise redis.ConnectionError(f"the broker cannot serve BRPOP now ({e}); reconnecting") from e

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
                queue = self._q_for_pri(routing_key, self._get_message_priority(message, reverse=False))
                pipe.lpush(queue, kombu_redis.dumps(message))  # the default exchange: key = queue, per priority
            pipe.zrem(self.unacked_index_key, delivery_tag)
            pipe.hdel(self.unacked_key, delivery_tag)
            pipe.execute()


def priority_queues(queue: str) -> list[str]:
    """The Redis lists of a queue, one per message priority (app/celery.py: priority_steps 0-9), in the
    order kombu takes them: priority 0 (the most urgent class, tasks.schema.broker_priority) first."""
    return [queue] + [f"{queue}{kombu_redis.Channel.sep}{p}" for p in range(1, 10)]


class Channel(StaleChannelSafe, kombu_redis.Channel):
    pass


class SentinelChannel(StaleChannelSafe, kombu_redis.SentinelChannel):
    """The same under Sentinel, where a failover is exactly such a reconnect."""

    connection_class = FailoverAwareConnection


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel
