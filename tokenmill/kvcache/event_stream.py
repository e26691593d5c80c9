"""The engine's end of KV events: a recorder on the prefix cache, a publisher,
and one batch per engine step that changed the cache."""

from __future__ import annotations

from tokenmill.config import KVEventsConfig
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.kvcache.events import KVEventRecorder


class KVEventStream:
    def __init__(self, recorder: KVEventRecorder, publisher) -> None:
        self.recorder = recorder
        self.publisher = publisher  # ZmqEventPublisher (or anything with publish/shutdown)

    @classmethod
    def start(cls, config: KVEventsConfig | None, block_manager: BlockManager,
              device_type: str = "cpu") -> KVEventStream | None:
        """None unless events are enabled with a zmq publisher."""
        if config is None or not config.active:
            return None
        if block_manager.prefix_cache is None:
            raise ValueError("KV cache events need prefix caching on")
        from tokenmill.kvcache.event_publisher import ZmqEventPublisher  # pyzmq only when used

        recorder = KVEventRecorder(block_manager.block_size,
                                   medium="GPU" if device_type == "cuda" else None)
        block_manager.prefix_cache.events = recorder
        return cls(recorder, ZmqEventPublisher(config))

    def publish(self) -> None:
        events = self.recorder.take()
        if events:
            self.publisher.publish(events)

    def close(self) -> None:
        self.publish()
        self.publisher.shutdown()
