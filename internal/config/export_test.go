package config

import "time"

// For the external tests, which load the configuration as run does, with
// the sinks' checks (startup).

// DurationSetting is a duration setting's key, variable and bound.
type DurationSetting struct {
	Key, Env string
	Doc      string        // how docs/configuration.md states the bound
	Below    time.Duration // the longest value the bound refuses
	Bounded  bool
}

func DurationSettings() []DurationSetting {
	bounds := durationBounds()
	var out []DurationSetting
	for _, s := range settings() {
		if _, ok := s.Default.(time.Duration); !ok {
			continue
		}
		d := DurationSetting{Key: s.Key, Env: s.Env()}
		if b, ok := bounds[s.Key]; ok {
			d.Bounded, d.Doc, d.Below = true, b.doc(), b.min-time.Nanosecond
			if b.above {
				d.Below = b.min
			}
		}
		out = append(out, d)
	}
	return out
}
