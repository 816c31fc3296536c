-- lease: ARGV caller (lib.lua), consumer, lease_id, action (ack | release | renew | adopt), lease_ms, rows...
-- ack ends the lease on rows the consumer is done with (consumed stays set); release gives them
-- back to the pool unprocessed; renew moves the deadline to now + lease_ms. Refused whole when
-- the lease no longer holds one of the rows. An ack skips rows already acked (consumed, leased by
-- nobody): redis-py sends a call again when the connection drops before its reply, and the first
-- ack may have been applied. adopt leases exactly `rows` to lease_id until now + lease_ms: a claim
-- the client was told succeeded but a failover lost (client.py puts it again), refused whole when
-- another claim took a row since or the row left the pool.
local meta, err = open(ARGV[1])
if not meta then return err end
local consumer, lease_id, action, lease_ms = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local now = now_ms()
requeue_expired(consumer, now)
local asked = {}
for i = 6, #ARGV do asked[#asked + 1] = ARGV[i] end
local owners = read_owners(consumer, asked)
if action == 'adopt' then
  redis.call('SADD', k('consumers'), consumer)
  local consumed, live = redis.call('GET', k('consumed:' .. consumer)) or '', redis.call('GET', k('live')) or ''
  for i, row in ipairs(asked) do
    if owners[i] ~= lease_id and (bit_at(consumed, tonumber(row)) or not bit_at(live, tonumber(row))) then
      return fail('DOCK_STALE', 'row ' .. row .. ' of a claim of ' .. consumer .. ' lost in a failover was claimed again or left the pool')
    end
  end
  local leases, held = {}, {}
  for _, row in ipairs(asked) do
    leases[#leases + 1] = now + lease_ms; leases[#leases + 1] = row
    held[#held + 1] = row; held[#held + 1] = lease_id
  end
  set_bits(k('consumed:' .. consumer), asked, 1)
  batched('ZADD', k('lease:' .. consumer), leases)
  batched('HSET', k('owner:' .. consumer), held)
  return now + lease_ms
end
local consumed = action == 'ack' and (redis.call('GET', k('consumed:' .. consumer)) or '') or ''
local rows, held = {}, {}
for i, row in ipairs(asked) do
  if not (action == 'ack' and not owners[i] and bit_at(consumed, tonumber(row))) then
    rows[#rows + 1] = row
    held[#held + 1] = owners[i]
  end
end
if #rows == 0 then return 0 end
local stale = check_owned(consumer, lease_id, rows, held)
if stale then return stale end
local lease_key = k('lease:' .. consumer)
if action == 'renew' then
  local scored = {}
  for _, row in ipairs(rows) do scored[#scored + 1] = now + lease_ms; scored[#scored + 1] = row end
  batched('ZADD', lease_key, scored, 'XX')
  return now + lease_ms
end
batched('ZREM', lease_key, rows)
batched('HDEL', k('owner:' .. consumer), rows)
if action == 'release' then
  set_bits(k('consumed:' .. consumer), rows, 0)
  wake_consumers()
end
return #rows
