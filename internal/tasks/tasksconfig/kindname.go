package tasksconfig

import (
	"fmt"
	"regexp"
)

// KindNameRule is River's rule for a kind's name (rivercommon's
// UserSpecifiedIDOrKindRE, which River checks when a worker is registered,
// and its river_job.kind length constraint), in an operator's words.
const KindNameRule = "a kind name is 2 to 127 characters: a letter, digit or _ first, then letters, digits and _ - . : / + [ ] < > ·"

var kindNameRE = regexp.MustCompile(`\A[\w][\w\-\[\]<>\/.·:+]+\z`)

// KindNameError is a task kind name River refuses: a kind River could
// never run, or could not store.
type KindNameError struct{ Name string }

func (e *KindNameError) Error() string {
	name := e.Name
	if len(name) > 40 {
		name = fmt.Sprintf("%s… (%d bytes)", name[:40], len(name))
	}
	return fmt.Sprintf("task kind %q: %s", name, KindNameRule)
}

// CheckKindName returns a *KindNameError unless River accepts name as a
// kind.
func CheckKindName(name string) error {
	if len(name) > 127 || !kindNameRE.MatchString(name) {
		return &KindNameError{Name: name}
	}
	return nil
}
