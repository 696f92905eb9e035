"""The `llmopt` command. Thin: it parses, calls the library, and renders results."""
