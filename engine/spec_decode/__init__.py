"""Speculative decoding: proposers guess the next tokens, the target model checks them all in one pass.

Importing this package is cheap (EngineConfig validates speculative_config through it); the proposers
and the rejection sampler live in their own modules."""
