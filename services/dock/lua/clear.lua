-- clear: ARGV caller (lib.lua), scope (pool | all). Empties the pool; the layout, the token and the
-- counters stay (the rows cleared count in `cleared`), unless scope is all (the run's every key
-- goes, the writer ledger and the timeline too: the run is over).
local meta, err = open(ARGV[1])
if not meta then return err end
redis.call('HINCRBY', k('meta'), 'cleared', redis.call('BITCOUNT', k('live')))
delete_pool(meta)
if ARGV[2] == 'all' then
  redis.call('DEL', k('meta'), k('consumers'), k('writers'), k('timeline'))
else
  -- The pool is empty, so from here on the `stored` set names every column with values (lib.lua's FORMAT).
  redis.call('HSET', k('meta'), 'complete', 0, 'format', FORMAT)
end
return 1
