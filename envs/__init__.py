"""Agent environments: tool managers (chat formats, tool-call parsers), tools, Ray tool pool, agent loop, storage."""
