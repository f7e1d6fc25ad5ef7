"""The cluster tier: the node's pools shared with other nodes through a Mooncake Store
(docs/design.md §13). `codec` is the key and value format (vLLM's), `mooncake` the store client
(blocking C++, called on this package's own thread only), `node` what the daemon runs: every
commit of a shared pool published in the background, `fetch` the remote hits: a shared pool's
misses read from the store."""
