"""What one SGLang instance adds: its request guard and routes, the memory plan and KV pool
sizing, and the embedded store it may start."""
