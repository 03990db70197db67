"""The KV store: a two-tier (RAM, disk) byte store for KV payloads and prefix blocks between
workers, and its client. Import from the modules themselves: the package re-exports nothing,
so a client does not load the store."""
