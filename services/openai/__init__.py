"""The OpenAI-compatible HTTP door: `/v1/models`, `/v1/completions`, `/v1/chat/completions` over
the gRPC Inference API of one server (or a router in front of several). No model state: the
`model` name is the base model or an adapter, and every call is one gRPC call."""
