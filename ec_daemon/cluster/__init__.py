"""The cluster tier: the node's pools shared with other nodes through a Mooncake Store
(docs/design.md §13). `tier` is the one object the rest of the daemon holds (`Cluster`), `codec`
the key and value format (vLLM's), `mooncake` the store client (blocking C++, called on this
package's own thread only; the one place bytes cross nodes), `node` what the daemon runs: every
commit of a shared pool published in the background, `fetch` the remote hits: a shared pool's
misses read from the store, `regions` the pools' memory the store's transfer engine reads and
writes."""
