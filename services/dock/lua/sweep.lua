-- sweep: requeues every consumer's expired leases; returns how many rows went back.
return requeue_all(now_ms())
