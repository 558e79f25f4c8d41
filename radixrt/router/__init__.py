"""Data parallel serving: a router in front of radixrt servers.

* `approx_tree`: the approximate multi-tenant radix tree of routed prefixes;
* `policies`: round_robin, shortest_queue, cache_aware;
* `keys`: a request body's routing key (its prompt);
* `workers`: the worker pool, loads and health checks;
* `app`: the HTTP front (proxy, failover, broadcast routes);
* `cli`: `radixrt router`; `dp`: `radixrt serve --dp N`.

Imports no torch: the router runs on a machine without the model stack.
"""
