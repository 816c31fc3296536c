-- all_consumed: ARGV consumer. 1 when every row in the pool was claimed by `consumer` and no
-- lease of it is outstanding (expired ones are requeued first), else 0.
local consumer = ARGV[1]
requeue_expired(consumer, now_ms())
if redis.call('ZCARD', k('lease:' .. consumer)) > 0 then return 0 end
local live = redis.call('GET', k('live')) or ''
local consumed = redis.call('GET', k('consumed:' .. consumer)) or ''
for i = 1, #live do
  local want = string.byte(live, i)
  if bit.band(want, bit.bnot(string.byte(consumed, i) or 0)) ~= 0 then return 0 end
end
return 1
