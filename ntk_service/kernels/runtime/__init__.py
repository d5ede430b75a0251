"""What long-lived callers keep warm and where kernels run: devices and their memory budgets, prepared-problem pools,
side caches, allocator tuning."""
