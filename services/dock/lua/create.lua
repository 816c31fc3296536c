-- create: ARGV caller (lib.lua), layout_json, n, capacity_rows, completion_column.
-- Replaces the run's pool (and its layout) with an empty one; refused under another token. The
-- writer ledger stays: the other writers' counts go on across a re-created pool.
local digest, writer, count = parse_caller(ARGV[1])
if not digest then return fail('DOCK_CALLER', 'malformed caller ' .. ARGV[1]) end
local meta = load_meta()
if meta and meta.token ~= '' and meta.token ~= digest then
  return fail('DOCK_AUTH', 'the dock under ' .. base .. ' was created with another token')
end
local lost = ledger(writer, count)
if lost then return lost end
if meta then delete_pool(meta) end
redis.call('DEL', k('meta'), k('consumers'))
redis.call('HSET', k('meta'), 'layout', ARGV[2], 'n', ARGV[3], 'capacity', ARGV[4], 'completion', ARGV[5],
  'token', digest, 'target', math.floor(tonumber(ARGV[4]) / tonumber(ARGV[3])), 'complete', 0, 'requeued', 0, 'retired', 0, 'admitted', 0, 'cleared', 0, 'rounds', 0, 'format', FORMAT)
return 1
