-- Read a rollout's meta and the frames of segments overlapping [lo, hi).
-- KEYS[1]  rollout hash
-- ARGV     lo, hi   (hi = -1: no upper bound)
-- Returns  {} when the rollout does not exist, else {meta, field1, frame1, field2, frame2, ...}
local key = KEYS[1]
local lo, hi = tonumber(ARGV[1]), tonumber(ARGV[2])
local meta = redis.call('HGET', key, 'm')
if not meta then return {} end
local out = {meta}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^s:(%d+):(%d+)$')
  if a then
    a = tonumber(a); b = tonumber(b)
    if b > lo and (hi < 0 or a < hi) then
      out[#out + 1] = f
      out[#out + 1] = redis.call('HGET', key, f)
    end
  end
end
return out
