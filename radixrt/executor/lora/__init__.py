"""Multi-LoRA serving: PEFT adapters (adapter.py), their batched products
over segments of rows (batch.py) and the pool of loaded adapters (pool.py)."""
