-- create: ARGV digest, layout_json, n, capacity_rows, completion_column.
-- Replaces the run's pool (and its layout) with an empty one; refused under another token.
local meta = load_meta()
if meta then
  if meta.token ~= '' and meta.token ~= ARGV[1] then
    return fail('DOCK_AUTH', 'the dock under ' .. base .. ' was created with another token')
  end
  delete_pool(meta)
end
redis.call('DEL', k('meta'), k('consumers'))
redis.call('HSET', k('meta'), 'layout', ARGV[2], 'n', ARGV[3], 'capacity', ARGV[4], 'completion', ARGV[5],
  'token', ARGV[1], 'target', math.floor(tonumber(ARGV[4]) / tonumber(ARGV[3])), 'complete', 0, 'requeued', 0, 'retired', 0, 'admitted', 0, 'cleared', 0)
return 1
