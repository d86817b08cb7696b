"""Tool calling on /v1/chat/completions: the request shapes (request.py), their checks and the constraint that
enforces `required` and named functions (plan.py), the parsers of each model's own call format (parsers.py), and the
OpenAI output shapes of the calls found (output.py)."""
