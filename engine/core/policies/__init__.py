"""The two batching policies: each looks at the scheduler's queues and returns a decision the scheduler
applies (continuous: iteration-level; static: request-level)."""
