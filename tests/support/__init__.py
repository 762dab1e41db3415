"""Test support: tiny local model, real vLLM engines, real xoscar pools."""
