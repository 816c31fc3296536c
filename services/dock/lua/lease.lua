-- lease: ARGV digest, consumer, lease_id, action (ack | release | renew), lease_ms, rows...
-- ack ends the lease on rows the consumer is done with (consumed stays set); release gives them
-- back to the pool unprocessed; renew moves the deadline to now + lease_ms. Refused whole when
-- the lease no longer holds one of the rows. An ack skips rows already acked (consumed, leased by
-- nobody): redis-py sends a call again when the connection drops before its reply, and the first
-- ack may have been applied.
local meta, err = open(ARGV[1])
if not meta then return err end
local consumer, lease_id, action, lease_ms = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local now = now_ms()
requeue_expired(consumer, now)
local consumed = redis.call('GET', k('consumed:' .. consumer)) or ''
local owner_key = k('owner:' .. consumer)
local rows = {}
for i = 6, #ARGV do
  local done = action == 'ack' and bit_at(consumed, tonumber(ARGV[i])) and redis.call('HEXISTS', owner_key, ARGV[i]) == 0
  if not done then rows[#rows + 1] = ARGV[i] end
end
if #rows == 0 then return 0 end
local stale = check_owned(consumer, lease_id, rows)
if stale then return stale end
for _, row in ipairs(rows) do
  if action == 'renew' then
    redis.call('ZADD', k('lease:' .. consumer), 'XX', now + lease_ms, row)
  else
    redis.call('ZREM', k('lease:' .. consumer), row)
    redis.call('HDEL', k('owner:' .. consumer), row)
    if action == 'release' then redis.call('SETBIT', k('consumed:' .. consumer), row, 0) end
  end
end
return action == 'renew' and now + lease_ms or #rows
