"""The shared test harness: brokers, controllers, agents, stacks, waits and fakes.

Test modules import from here and never from each other; bench/ imports this package and nothing
else of tests/.
"""
