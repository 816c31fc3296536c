-- Shared by every dock script (prepended by scripts.py). KEYS[1] is the run's key base
-- "{prefix}:{run_id}:"; errors start with a tag the client maps to a typed error.
local base = KEYS[1]
local function k(name) return base .. name end

local function fail(tag, message) return redis.error_reply(tag .. ' ' .. message) end

-- The fields of the run's meta hash that scripts use, as a table; nil when the dock was never
-- created. The layout (JSON) is left out: only deleting the whole pool needs it (layout_columns).
local META_FIELDS = {'token', 'n', 'capacity', 'completion', 'target', 'complete', 'format'}

-- The pool's key format, meta's `format`, written by create and clear (an empty pool). 2: the
-- `stored` set names every column that holds values. A pool made before it (no `format`) holds
-- values no put recorded there, and keeps the old way of retiring rows (drop_rows).
local FORMAT = 2
local function load_meta()
  local values = redis.call('HMGET', k('meta'), unpack(META_FIELDS))
  if not values[2] then return nil end
  local meta = {}
  for i, name in ipairs(META_FIELDS) do meta[name] = values[i] end
  return meta
end

local function layout_columns() return cjson.decode(redis.call('HGET', k('meta'), 'layout')).columns end

-- A writing call's first argument names its caller: "digest writer count", the token's digest
-- (empty: no token), the client's writer id and how many of its calls the store has run. The
-- writer ledger (hash `writers`) keeps that count per writer. A count above the stored one means
-- the store lost calls it had acknowledged: a failover to a replica that had not received them
-- (asynchronous replication). Then nothing runs and DOCK_LOST tells the client how many it
-- holds, so it can put them again (client.py). A stored count above the caller's is a call
-- sent again after a dropped reply, and runs as it always did.
local function parse_caller(caller)
  return string.match(caller, '^(%x*) (%S+) (%d+)$')
end

-- Returns the DOCK_LOST error reply when the store lost calls of `writer`; else counts this one.
local function ledger(writer, count)
  local stored = redis.call('HGET', k('writers'), writer)
  if stored and tonumber(stored) < tonumber(count) then
    return fail('DOCK_LOST', stored .. ' of ' .. count .. ' calls of writer ' .. writer .. ' are in the store')
  end
  redis.call('HSET', k('writers'), writer, tonumber(count) + 1)
  return nil
end

-- Returns meta, or nil plus the error reply to return (not created / wrong token / lost calls).
local function open(caller)
  local digest, writer, count = parse_caller(caller)
  if not digest then return nil, fail('DOCK_CALLER', 'malformed caller ' .. caller) end
  local meta = load_meta()
  if not meta then return nil, fail('DOCK_NOT_CREATED', 'no dock under ' .. base .. '; the trainer creates it') end
  if meta.token ~= '' and meta.token ~= digest then
    return nil, fail('DOCK_AUTH', 'the dock under ' .. base .. ' needs the run\'s token for this call')
  end
  local lost = ledger(writer, count)
  if lost then return nil, lost end
  return meta
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Bit i of a Redis bitmap string (most significant bit first, as SETBIT writes it).
local function bit_at(bitmap, i)
  local byte = string.byte(bitmap, math.floor(i / 8) + 1)
  if not byte then return false end
  return bit.band(byte, bit.rshift(128, i % 8)) ~= 0
end

-- Calls `command key [option] items...` over `items` in slices of 1000 (Lua's unpack has a
-- stack limit): one Redis command per slice instead of one per item. Slices are even-sized, so
-- score-member pairs (ZADD) and field-value pairs (HSET) stay together.
local function batched(command, key, items, option)
  for first = 1, #items, 1000 do
    local last = math.min(first + 999, #items)
    if option then
      redis.call(command, key, option, unpack(items, first, last))
    else
      redis.call(command, key, unpack(items, first, last))
    end
  end
end

-- Sets bit `row` of bitmap `key` to `value` for every row of `rows`; returns the bits as they were
-- before, one per row (a row given twice sees its first change, as with one SETBIT after another).
-- The bitmap is read once, changed in Lua and written back with one SETRANGE over the bytes from
-- the first changed one to the last: BITFIELD costs Redis about 1 us per bit (its parsing and
-- per-operation bookkeeping), which made it a large share of a claim's and a put's time.
local function set_bits(key, rows, value)
  local bitmap = redis.call('GET', key) or ''
  local changed, old = {}, {}  -- changed: byte index (1-based) -> its new value
  local lo, hi = math.huge, 0
  for i, row in ipairs(rows) do
    row = tonumber(row)
    local index = math.floor(row / 8) + 1
    local byte = changed[index] or string.byte(bitmap, index) or 0
    local mask = bit.rshift(128, row % 8)
    old[i] = bit.band(byte, mask) ~= 0 and 1 or 0
    changed[index] = value == 1 and bit.bor(byte, mask) or bit.band(byte, bit.bnot(mask))
    if index < lo then lo = index end
    if index > hi then hi = index end
  end
  if hi == 0 then return old end
  local span, chars = {}, {}
  for index = lo, hi do span[#span + 1] = changed[index] or string.byte(bitmap, index) or 0 end
  for first = 1, #span, 4000 do chars[#chars + 1] = string.char(unpack(span, first, math.min(first + 3999, #span))) end
  redis.call('SETRANGE', key, lo - 1, table.concat(chars))
  return old
end

-- Rows of `consumer` whose lease deadline passed go back to the pool; returns how many.
local function requeue_expired(consumer, now)
  local lease_key = k('lease:' .. consumer)
  local expired = redis.call('ZRANGEBYSCORE', lease_key, '-inf', now)
  if #expired == 0 then return 0 end
  set_bits(k('consumed:' .. consumer), expired, 0)
  batched('HDEL', k('owner:' .. consumer), expired)
  redis.call('ZREMRANGEBYSCORE', lease_key, '-inf', now)
  redis.call('HINCRBY', k('meta'), 'requeued', #expired)
  return #expired
end

local function requeue_all(now)
  local total = 0
  for _, consumer in ipairs(redis.call('SMEMBERS', k('consumers'))) do
    total = total + requeue_expired(consumer, now)
  end
  return total
end

-- The owner field (lease id, or false) of each of `rows` under `consumer`.
local function read_owners(consumer, rows)
  local owners = {}
  for first = 1, #rows, 1000 do
    for _, owner in ipairs(redis.call('HMGET', k('owner:' .. consumer), unpack(rows, first, math.min(first + 999, #rows)))) do
      owners[#owners + 1] = owner
    end
  end
  return owners
end

-- Error reply naming the first rows of `rows` that `lease_id` of `consumer` does not hold, or nil;
-- `owners`: the rows' owner fields when the caller read them already (read_owners).
local function check_owned(consumer, lease_id, rows, owners)
  owners = owners or read_owners(consumer, rows)
  local stale = {}
  for i, owner in ipairs(owners) do
    if owner ~= lease_id then
      stale[#stale + 1] = rows[i]
      if #stale == 5 then break end
    end
  end
  if #stale > 0 then
    return fail('DOCK_STALE', 'lease of ' .. consumer .. ' no longer holds rows ' .. table.concat(stale, ',') ..
      ' (expired and requeued, or taken over)')
  end
  return nil
end

-- Deletes `keys` in batches (unpack has a stack limit).
local function delete_keys(keys)
  for first = 1, #keys, 1000 do
    redis.call('DEL', unpack(keys, first, math.min(first + 999, #keys)))
  end
end

-- A value's key is value_prefix(column) .. row: loops over rows concatenate two strings per key, not five.
local function value_prefix(column) return base .. 'val:' .. column .. ':' end

-- Clears the bits of `rows` in every bitmap of `keys` that exists: one BITOP AND with a mask
-- per bitmap instead of one SETBIT per row and bitmap.
local function clear_bits(keys, rows, capacity)
  local keep = {}
  for i = 1, math.ceil(capacity / 8) do keep[i] = 255 end
  for _, row in ipairs(rows) do
    local byte = math.floor(row / 8) + 1
    keep[byte] = bit.band(keep[byte], bit.bnot(bit.rshift(128, row % 8)))
  end
  local chars = {}
  for first = 1, #keep, 4000 do chars[#chars + 1] = string.char(unpack(keep, first, math.min(first + 3999, #keep))) end
  local mask = k('mask')
  redis.call('SET', mask, table.concat(chars))
  for _, key in ipairs(keys) do
    if redis.call('EXISTS', key) == 1 then redis.call('BITOP', 'AND', key, key, mask) end
  end
  redis.call('DEL', mask)
end

-- Removes rows from every key of the run (values, flags, leases, ages, admission order, completion counts).
local function drop_rows(meta, rows)
  if #rows == 0 then return end
  local n = tonumber(meta.n)
  local consumers = redis.call('SMEMBERS', k('consumers'))
  local bitmaps, values, groups, seen = {k('live')}, {}, {}, {}
  -- Only the columns some put wrote (put.lua's `stored`): the layout's other columns have no
  -- values or ready flags to remove, and making and deleting their keys was a third of the work.
  -- A pool older than the set (FORMAT) may hold values of any layout column: all of them go.
  local columns
  if tonumber(meta.format or '1') >= FORMAT then
    columns = redis.call('SMEMBERS', k('stored'))
  else
    columns = {}
    for i, column in ipairs(layout_columns()) do columns[i] = column.name end
  end
  for _, column in ipairs(columns) do
    bitmaps[#bitmaps + 1] = k('ready:' .. column)
    local prefix = value_prefix(column)
    for _, row in ipairs(rows) do values[#values + 1] = prefix .. row end
  end
  for _, consumer in ipairs(consumers) do
    bitmaps[#bitmaps + 1] = k('consumed:' .. consumer)
    -- Leases and owners are only there for rows some worker still holds: mostly none.
    if redis.call('ZCARD', k('lease:' .. consumer)) > 0 then batched('ZREM', k('lease:' .. consumer), rows) end
    if redis.call('HLEN', k('owner:' .. consumer)) > 0 then batched('HDEL', k('owner:' .. consumer), rows) end
  end
  clear_bits(bitmaps, rows, tonumber(meta.capacity))
  batched('HDEL', k('version'), rows)
  batched('HDEL', k('rowage'), rows)
  delete_keys(values)
  for _, row in ipairs(rows) do
    local group = math.floor(tonumber(row) / n)
    if not seen[group] then seen[group] = true; groups[#groups + 1] = group end
  end
  local complete = 0
  for first = 1, #groups, 1000 do
    for _, done in ipairs(redis.call('HMGET', k('done'), unpack(groups, first, math.min(first + 999, #groups)))) do
      if tonumber(done or '0') >= n then complete = complete + 1 end
    end
  end
  if complete > 0 then redis.call('HINCRBY', k('meta'), 'complete', -complete) end
  batched('HDEL', k('done'), groups)
  batched('ZREM', k('age'), groups)
  batched('ZREM', k('order'), groups)
end

-- Wakes the consumers whose claims found nothing and wait (claim.lua put them in `waiting` with
-- the end of their wait): one token on each one's wake key, which its BLPOP in client.py takes.
-- A token nobody took (the wait ended first) goes a second after the wait's end.
local function wake_consumers()
  local waiting = redis.call('HGETALL', k('waiting'))
  if #waiting == 0 then return end
  local now = now_ms()
  for i = 1, #waiting, 2 do
    local until_ms = tonumber(waiting[i + 1])
    if until_ms > now then
      local key = k('wake:' .. waiting[i])
      redis.call('RPUSH', key, 1)
      redis.call('PEXPIREAT', key, until_ms + 1000)
    end
  end
  redis.call('DEL', k('waiting'))
end

-- Deletes every data key of the run: every row's values, flags, leases, ages (not meta).
local function delete_pool(meta)
  local keys = {k('live'), k('version'), k('rowage'), k('age'), k('order'), k('done'), k('waiting'), k('stored')}
  local capacity = tonumber(meta.capacity)
  for _, column in ipairs(layout_columns()) do
    keys[#keys + 1] = k('ready:' .. column.name)
    local prefix = value_prefix(column.name)
    for row = 0, capacity - 1 do keys[#keys + 1] = prefix .. row end
  end
  for _, consumer in ipairs(redis.call('SMEMBERS', k('consumers'))) do
    keys[#keys + 1] = k('consumed:' .. consumer)
    keys[#keys + 1] = k('lease:' .. consumer)
    keys[#keys + 1] = k('owner:' .. consumer)
    keys[#keys + 1] = k('wake:' .. consumer)
  end
  delete_keys(keys)
end
