"""Choosing a plan: a topology, a cost model of embshard's data path, a search that
balances the slowest rank within memory, hot rows and lookup-balanced cuts from
measured traffic, and a report. Pure: it takes tables and a topology, never the
application's config."""
