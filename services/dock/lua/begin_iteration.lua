-- begin_iteration: ARGV caller (lib.lua), final_consumer, target_groups.
-- Drops the groups `final_consumer` has claimed and released (trained or filtered), keeps the
-- unfinished ones with their ages, sets the iteration's target of complete groups and returns
-- {dropped_groups, free group ids...}: the slots the caller fills with new prompts.
local meta, err = open(ARGV[1])
if not meta then return err end
local final_consumer, target = ARGV[2], ARGV[3]
local n = tonumber(meta.n)
requeue_all(now_ms())
local consumed = redis.call('GET', k('consumed:' .. final_consumer)) or ''
local leased = {}
for _, row in ipairs(redis.call('ZRANGE', k('lease:' .. final_consumer), 0, -1)) do leased[tonumber(row)] = true end
local drop, live = {}, {}
local dropped = 0
for _, group in ipairs(redis.call('ZRANGE', k('age'), 0, -1)) do
  local first = tonumber(group) * n
  local finished = true
  for row = first, first + n - 1 do
    if not bit_at(consumed, row) or leased[row] then finished = false break end
  end
  if finished then
    dropped = dropped + 1
    for row = first, first + n - 1 do drop[#drop + 1] = tostring(row) end
  else
    live[tonumber(group)] = true
  end
end
drop_rows(meta, drop)
redis.call('HINCRBY', k('meta'), 'retired', dropped)
-- The groups put from here on are the next admission round (put.lua's `order`: claims take older rounds first).
redis.call('HINCRBY', k('meta'), 'rounds', 1)
redis.call('HSET', k('meta'), 'target', target)
local reply = {dropped}
for group = 0, math.floor(tonumber(meta.capacity) / n) - 1 do
  if not live[group] then reply[#reply + 1] = group end
end
return reply
