"""The network edge: TLS, what any one peer may cost, an emulated link, and the typed reasons a request is refused."""
