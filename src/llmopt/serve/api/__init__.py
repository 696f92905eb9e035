"""The OpenAI-compatible HTTP surface: routes, typed requests and responses, streaming."""
