"""KV-cache transfer between engines: prefill/decode disaggregation (docs/scale-out.md).

The engine talks to them through `engine/core/kv_transfer.py`; `producer` pins and serves
a finished prefill's blocks, `consumer` pulls them into its own pool; `wire` is the
format on the wire and the layout handshake; `transport` the ZMQ-over-TCP transport.
"""
