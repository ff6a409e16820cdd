package config

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/worker-dev/worker/internal/obs"
)

// What a bad value is told it should be, in every message about one: a
// top-level key, an environment variable, or a field of a list entry.
const (
	wantDuration    = "is not a duration; want a number with a unit, such as 3s, 500ms or 5m"
	wantWholeNumber = "is not a whole number"
	wantBoolean     = "is not a boolean; want true or false"
	wantText        = "is not a single value; want text"
	wantPairs       = "is not a mapping; want name: value pairs"
)

// checkListEntries checks the YAML-only list at key (jobs, tasks.kinds,
// inbox.sources), whose entries decode into t, before the decoder sees it:
// the decoder's own errors ("'jobs[0].delay' time: invalid duration") give
// neither the file's line, nor the value, nor what is allowed. Each unknown
// key and each value that does not parse as its field's type is reported,
// every entry's, as file:line: key[i] "name": field=value and the form it
// must take, as top-level keys are.
func checkListEntries(key string, raw any, t reflect.Type, lines lineFinder) []error {
	if raw == nil {
		return nil
	}
	path := strings.Split(key, ".")
	list, ok := raw.([]any)
	if !ok {
		return []error{fmt.Errorf("%s: %s must be a list of entries with %s", lines.at(path...), key, strings.Join(tagNames(t)[:2], ", ")+", ...")}
	}
	var errs []error
	for i, item := range list {
		at := append(slices.Clone(path), strconv.Itoa(i))
		m, ok := item.(map[string]any)
		if !ok {
			errs = append(errs, fmt.Errorf("%s: %s[%d] must be a mapping with %s, ...", lines.at(at...), key, i, strings.Join(tagNames(t)[:2], ", ")))
			continue
		}
		entry := fmt.Sprintf("%s[%d]", key, i)
		if name, ok := m["name"].(string); ok {
			entry += fmt.Sprintf(" %q", name)
		}
		errs = append(errs, checkEntryFields(entry, "", m, t, at, lines)...)
	}
	return errs
}

// checkEntryFields checks the keys of m, a mapping decoded into t; prefix
// is the path of m within the entry ("" or "nats.").
func checkEntryFields(entry, prefix string, m map[string]any, t reflect.Type, at []string, lines lineFinder) []error {
	var errs []error
	allowed := tagNames(t)
	for _, k := range slices.Sorted(maps.Keys(m)) {
		where := lines.at(append(slices.Clone(at), k)...)
		f, ok := fieldByTag(t, k)
		if !ok {
			errs = append(errs, fmt.Errorf("%s: %s: unknown key %q%s; allowed: %s",
				where, entry, prefix+k, didYouMean(k, allowed), strings.Join(allowed, ", ")))
			continue
		}
		if sub, ok := m[k].(map[string]any); ok && f.Type.Kind() == reflect.Struct && f.Type != durationType {
			errs = append(errs, checkEntryFields(entry, prefix+k+".", sub, f.Type, append(slices.Clone(at), k), lines)...)
			continue
		}
		if problem := valueProblem(f.Type, m[k]); problem != "" {
			errs = append(errs, fmt.Errorf("%s: %s: %s=%s %s", where, entry, prefix+k, shownValue(f, m[k]), problem))
		}
	}
	return errs
}

// fieldByTag is the field of struct type t whose koanf tag is name.
func fieldByTag(t reflect.Type, name string) (reflect.StructField, bool) {
	for f := range t.Fields() {
		if f.Tag.Get("koanf") == name {
			return f, true
		}
	}
	return reflect.StructField{}, false
}

// fieldByKey is the field of struct type t at a dotted key ("nats.url").
func fieldByKey(t reflect.Type, key string) (reflect.StructField, bool) {
	var f reflect.StructField
	for part := range strings.SplitSeq(key, ".") {
		if t.Kind() != reflect.Struct {
			return f, false
		}
		var ok bool
		if f, ok = fieldByTag(t, part); !ok {
			return f, false
		}
		t = f.Type
	}
	return f, true
}

// valueProblem says why v, from YAML or the environment (a string), cannot
// be a value of type t, or "" when it can. The decoder converts weakly
// (a number to text, 1 to true), and so does this.
func valueProblem(t reflect.Type, v any) string {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	_, isList := v.([]any)
	_, isMap := v.(map[string]any)
	switch {
	case t == durationType:
		if err := checkUnitless(v); err != nil {
			return wantDuration
		}
		if s, ok := v.(string); ok {
			if _, err := time.ParseDuration(s); err != nil {
				return wantDuration
			}
		} else if isList || isMap {
			return wantDuration
		}
	case t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64:
		switch n := v.(type) {
		case string:
			if _, err := strconv.ParseInt(n, 10, 64); err != nil {
				return wantWholeNumber
			}
		case float64:
			if n != float64(int64(n)) {
				return wantWholeNumber
			}
		case []any, map[string]any:
			return wantWholeNumber
		}
	case t.Kind() == reflect.Bool:
		switch b := v.(type) {
		case string:
			if _, err := strconv.ParseBool(b); err != nil {
				return wantBoolean
			}
		case []any, map[string]any:
			return wantBoolean
		}
	case t.Kind() == reflect.String:
		if isList || isMap {
			return wantText
		}
	case t.Kind() == reflect.Map:
		m, ok := v.(map[string]any)
		if !ok {
			return wantPairs
		}
		for _, e := range m {
			if valueProblem(t.Elem(), e) != "" {
				return wantPairs
			}
		}
	case t.Kind() == reflect.Struct:
		if !isMap {
			return "is not a mapping; want keys such as " + strings.Join(tagNames(t)[:min(3, t.NumField())], ", ")
		}
	}
	return ""
}

// shownValue is v as a message shows it: quoted when text, masked when the
// field holds a secret, and only its shape when a list or a mapping (whose
// parts may be secrets: header values).
func shownValue(f reflect.StructField, v any) string {
	switch v := v.(type) {
	case []any:
		return "[...]"
	case map[string]any:
		return "{...}"
	case string:
		if f.Tag.Get("secret") != "" || obs.IsSecretKey(f.Tag.Get("koanf")) {
			return obs.Masked
		}
		return strconv.Quote(v)
	}
	return fmt.Sprint(v)
}
