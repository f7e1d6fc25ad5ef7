"""The tensor side: a pool mapped into the process and registered with CUDA (`mapping`,
`cuda_runtime`), tensor bytes to and from extents (`mover`), and `Producer` and `Consumer`
(`producer`, `consumer`, over what they share, `endpoint`). Imports torch, so `ec_client` loads it
on first use."""
