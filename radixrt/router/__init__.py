"""Data parallel serving: a router in front of radixrt servers.

* `approx_tree`: the approximate multi-tenant radix tree of routed prefixes;
* `policies`: round_robin, shortest_queue, cache_aware;
* `keys`: a request body's routing key (its prompt);
* `kv_event_index`, `kv_event_subscriber`, `token_keys`, `kv_routing`: the
  workers' KV cache events (what each cache holds), their ZMQ subscriber, a
  request's token ids and namespace, and their wiring (cache_aware's source
  when the workers publish events; the approximate tree stays the fallback);
* `workers`: the worker pool, loads and health checks;
* `app`: the HTTP front (proxy, failover); `broadcast`: the routes sent to
  every worker (flush, abort, LoRA loads); `state`: what the routes share;
* `cli`: `radixrt router`; `dp`: `radixrt serve --dp N`.

Imports no torch: the router runs on a machine without the model stack.
"""
