"""Global KV Cache Store: content-addressed KV pages shared by every instance."""
